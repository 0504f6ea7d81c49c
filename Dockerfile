FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY tokenization ./tokenization
COPY routing ./routing
COPY bench ./bench
RUN pip install --no-cache-dir .
EXPOSE 8000
ENTRYPOINT ["prefixgate"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

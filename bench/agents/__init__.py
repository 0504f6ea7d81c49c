"""The real-agent tier: Claude Code, Codex CLI and opencode from the npm registry, run offline
through prefixgate against simulated ranks in scripted-tool mode (``bench/agents/test.sh``)."""

"""The real-agent tier: Claude Code, Codex CLI and opencode from the npm registry, run offline
through prefixgate against simulated ranks in scripted-tool mode (``tests/agents/test.sh``)."""

"""OpenAI-compatible HTTP serving of the engine: two-phase start-up, health, metrics, auth and limits."""

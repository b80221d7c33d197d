"""What a recipe runs: each module has `run(cfg)` taking the composed, validated RunConfig."""

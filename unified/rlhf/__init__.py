"""Reinforcement learning on the shared model: rollouts from the inference engine, updates through the
DeepSpeed trainer. The algorithm's arithmetic (advantages, losses) and the reward contract live here;
each is plain PyTorch over per-token tensors, so GRPO and PPO share them."""

"""Pure RL algorithm functions over tensors: advantages.py (GRPO, RLOO, REINFORCE++, GAE),
losses.py (PPO policy and value losses, loss aggregation, log-probs, entropy) and kl.py (KL
estimators, KL controllers, KL reward penalty). No models, workers or config here."""

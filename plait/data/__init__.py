"""Data for RL post-training: prompt datasets, built-in verifiable tasks and their rewards.

- `tasks.py`: the built-in tasks (arithmetic, reverse, gsm8k_synthetic) as rows in verl's parquet format.
- `word_problems.py`: synthetic GSM8K-style word problems (GSM8K's format, not GSM8K) for a real model.
- `dataset.py`: rows from parquet/JSONL, tokenized prompts, seeded batches.
- `rewards.py`: rule-based rewards by `data_source`; users' reward functions loaded from a file.
- `warmstart.py`: a short supervised warm start so RL on the tiny model has something to improve.

Nothing is imported here, so `import plait.data` stays light.
"""

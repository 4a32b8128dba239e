"""plait: RL post-training for language models and diffusion policies.

Every trainer mode runs one step lifecycle (plait/trainers/lifecycle.py), so profiling, timing,
checkpoints, validation and logging are written once. `import plait` stays light: it imports
neither torch-heavy modules nor ray.
"""

__version__ = "0.1.0"

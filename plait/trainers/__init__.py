"""Trainer modes. Each supplies only what differs; all run plait/trainers/lifecycle.py. The table of
modes, name -> the function that builds its trainer, is plait/build.py's MODES."""

"""Starting a run from existing weights (the manifest's `init:` section): a Hugging Face directory or a
mantra checkpoint, read into the model this rank built (hf_dir.py: torch-free checks of the directory;
hf_weights.py: each rank's slices; weights.py: which source, and when)."""

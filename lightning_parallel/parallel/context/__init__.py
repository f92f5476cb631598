"""Context parallelism: each rank of a ``cp`` group holds a part of every sequence.

``chunks.py`` says which part (head-tail balanced chunks), ``attention.py`` runs attention over
the whole sequence from those parts (all-gather of keys and values, or a ring), ``batch.py``
splits a batch and ``hf.py`` routes a Hugging Face model's attention, positions and ``labels=``
loss through them. Pure PyTorch: no Lightning import.
"""

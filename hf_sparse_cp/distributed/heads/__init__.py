"""Head parallelism (Ulysses) and its hybrid with the ring: the head split, the all-to-alls, the attention."""

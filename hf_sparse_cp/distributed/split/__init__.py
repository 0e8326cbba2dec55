"""How a sequence splits over a CP group: block splits, the document-aware split, the sharded model inputs."""

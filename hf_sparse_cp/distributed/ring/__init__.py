"""The balanced sparse ring: CP estimation of the global layout, the ring's plan, ring attention."""

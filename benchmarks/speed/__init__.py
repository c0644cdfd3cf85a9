"""How fast ``generate`` runs against plain, compiled and assisted HF generation, and the host's work per step."""

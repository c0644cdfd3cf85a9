"""Model-card template and shipped routers; the template is installed as package data r2r_hf._hub_cards."""

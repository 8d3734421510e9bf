"""Publishing a finished run: its dataset card (card.py) and its push to the Hugging Face Hub (hub.py)."""

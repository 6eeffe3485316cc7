"""The method layer (layer.py): everything a method decides, one object for both training backends."""

"""Experiments that reproduce the papers' findings; the ``privfusion experiment`` commands run them."""

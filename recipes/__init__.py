"""Shipped recipes (YAML package data). Names are paths below this folder without `.yaml`."""

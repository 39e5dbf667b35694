"""Displays of graphs and reports: text tables and HTML for Jupyter."""

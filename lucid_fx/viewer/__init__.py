"""Renderers for visualize: SVG (also inside the HTML viewer), the self-contained HTML viewer,
Graphviz DOT. The viewer's script and style ship beside this file as package data."""

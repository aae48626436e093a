"""Configuration: typed sections, YAML files and dotted overrides, checked before anything runs.
"""

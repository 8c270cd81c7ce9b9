"""Omnistage: serve multi-stage omni-modal model pipelines locally or on Kubernetes."""

__version__ = "0.1.0"

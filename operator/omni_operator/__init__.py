"""The Omnistage Kubernetes operator (kopf): OmniPipeline and StagePool reconciliation."""

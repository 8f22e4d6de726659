"""Deployment checks: manifests, Helm chart, example configs, the image smoke test."""

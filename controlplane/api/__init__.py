"""The REST API of the control plane: the FastAPI application and its routes."""

"""The REST API's routes, one module per resource."""

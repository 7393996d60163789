"""The reconciler: compares declared state with what the infrastructure shows, and corrects it."""

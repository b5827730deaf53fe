"""Cell compute: stages of cells, their pipeline actions and boundary transfers."""

"""Host processes leading many clusters: real processes, killed and cut off (issue 31)."""

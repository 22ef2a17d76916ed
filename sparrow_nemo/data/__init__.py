"""Prompt datasets on disk: finding and reading their rows with bounds (:mod:`.readers`)."""

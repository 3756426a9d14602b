"""The report's sections: each a function of one model's view (or, for the overview, of
every model), returning Markdown."""

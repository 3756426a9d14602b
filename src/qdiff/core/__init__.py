"""The vocabulary every other part of qdiff speaks: names, records, the stage table, device
settings, backends, the config, atomic files, hidden values, Markdown for untrusted text, and
file hashes. Pure Python that loads no native code, so the Snakefile and every job's
supervising process can import it; it imports nothing else of qdiff."""

"""Page-cache work, below the formats and above system: memory maps kept across readers
(maps.py), telling which pages are cached (probe.py), asking for pages ahead of their reads
(advise.py: madvise, populate, the read-ahead of an epoch's blocks) and copying a batch's rows
out of a map (copy.py). The formats call it; it knows no format.
"""

"""The baseline store: one YAML file per device class, entries keyed by test node id.

- :mod:`.store`: the files of a directory, by device class, each named for its device;
- :mod:`.file`: one file, read (fast or careful) and written whole;
- :mod:`.layout`: the text the writer writes, with the header and closing line of a whole file;
- :mod:`.errors`: the error that names the file and line of a fault;
- :mod:`.scan`: the fast reader of that layout; :mod:`.yamlfile`: the careful reader of any other;
- :mod:`.progress`: the words on stderr while a big file loads;
- :mod:`.writer`: a run's changes merged into the files, under their locks;
- :mod:`.locks`, :mod:`.gitignore`: what the writer leaves beside a file, and keeps out of git;
- :mod:`.compare`: a test's figures against its entry.

Nothing is imported here: the idle plugin loads this package's modules only when it needs them.
"""

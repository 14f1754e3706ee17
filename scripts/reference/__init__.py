"""The docs site's generated reference pages: written from the code, so they cannot drift from it.

`python -m scripts.reference` writes them; `python -m scripts.reference --check` fails, naming each stale page,
when the code changed and they were not written again (tests/project/test_docs_site.py runs it).
"""

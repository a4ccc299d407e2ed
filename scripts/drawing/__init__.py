"""drawing: each chapter's figures, drawn from its results.json alone (no rank is launched).

``chapterNN.py`` has ``draw(results, folder)`` and ``SCHEMA`` (the keys it reads, checked before
anything is drawn); the chapter script and ``--replot`` both call it.  Imports ddplab.run
(plotting, replot, timeline), never a chapter's backstage and no concept, with one exception
that tests/test_layout.py names: chapter06.py draws the bubble with
``ddplab.stragglers.idle_events``, the idle time as the concept defines it.

    chapter01.py  chapter02.py  chapter03.py  chapter04.py  chapter05.py  chapter06.py
    chapter07.py  chapter09.py  chapter10.py  chapter11.py
                   one module per chapter that draws figures (08 writes diffs, not figures)
    diagrams.py    the drawn diagrams (ideas before measurements), run as a script:
                   python scripts/drawing/diagrams.py
"""

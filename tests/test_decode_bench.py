"""benchmarks/decode.py's --forms on the CPU: what it refuses before any GPU work, and that
every --forms of benchmarks/h200_session.sh names options its routes pass to their kernels
(a misspelt one would time the route's set as it is, under the form's name)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from benchmarks.decode import parse_forms, parse_point
from mlatune import routes

SESSION_SCRIPT = Path(__file__).parents[1] / "benchmarks" / "h200_session.sh"


@pytest.mark.parametrize(("text", "why"), [
    ('{"seesaw/gluon": [{}, {"afresh": true}]}', "has no kernel option afresh"),
    ('{"no/route": [{}]}', "unknown route 'no/route'"),
    ('{"seesaw/gluon": {"afresh_q": true}}', "a JSON object of route id -> list"),
])
def test_forms_that_name_no_kernel_option_are_refused(text, why):
    with pytest.raises(SystemExit, match=why):
        parse_forms(text)


def test_every_forms_of_the_session_script_names_kernel_options():
    found = re.findall(r"--forms\s*(?:\\\n\s*)?'([^']*)'", SESSION_SCRIPT.read_text())
    assert found  # the script's A/B steps
    for text in found:
        for route_id, forms in parse_forms(text):
            options = routes.get(route_id).kernel_options
            assert all(name in options for form in forms for name, _ in form), text


def test_a_point_of_ones_own_is_four_positive_integers():
    assert parse_point("1,32,1024,4") == (1, 32, 1024, 4)
    for text in ("1,32,1024", "1,0,1024,1", "1,32,x,1", "1,32,1024,1,1"):
        with pytest.raises(argparse.ArgumentTypeError, match="batch,heads,kv_len,qlen"):
            parse_point(text)

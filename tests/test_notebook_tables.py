"""The table check that runs inside every notebook kernel of `make test` (see notebook_tables.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from IPython.core.interactiveshell import InteractiveShell
from notebook_tables import check_table, install


def _old_notebook_06_table() -> pd.DataFrame:
    # What notebook 06 built: one SGD column per tuned rate, renamed to the same name.
    rows = [{"task": "a", "learned": 0.1, "SGD tuned lr 0.1": 0.2},
            {"task": "b", "learned": 0.3, "SGD tuned lr 1": 0.4}]
    table = pd.DataFrame(rows).set_index("task")
    table.columns = [c.split(" lr")[0] if c.startswith("SGD") else c for c in table.columns]
    return table


def test_duplicate_or_valueless_columns_are_refused_and_a_good_table_passes():
    with pytest.raises(AssertionError, match=r"duplicate columns \['SGD tuned'\]"):
        check_table(_old_notebook_06_table())
    with pytest.raises(AssertionError, match=r"without any value.*\['b'\]"):
        check_table(pd.DataFrame({"a": [1.0, 2.0], "b": [np.nan, np.nan]}).style)
    good = pd.DataFrame({"a": [1.0, np.nan], "b": [np.nan, 2.0]})
    assert check_table(good) is good and check_table(3) == 3


def test_a_kernel_cell_ending_in_a_bad_table_fails_and_others_run_unchanged():
    shell = InteractiveShell.instance()
    try:
        install(shell)
        shell.user_ns["bad"] = _old_notebook_06_table()
        assert isinstance(shell.run_cell("x = 2\nbad.round(3)").error_in_exec, AssertionError)
        result = shell.run_cell("x + 40")
        assert result.success and result.result == 42
        assert shell.run_cell("import pandas as pd\npd.DataFrame({'a': [1]})").success
    finally:
        InteractiveShell.clear_instance()


def test_notebook_kernels_get_the_check_through_their_startup_file():
    startup = Path(os.environ["IPYTHONDIR"]) / "profile_default" / "startup" / "00-carlskit-table-check.py"
    assert "notebook_tables.install(get_ipython())" in startup.read_text()

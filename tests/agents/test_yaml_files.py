"""The agent side's YAML files (tool, interaction and agent-loop configs) are read as verl's configs are: an
alias bomb (the billion-laughs document) is one line naming the file, refused before anything is built, in
each of the four readers."""

import pytest

from plait.agents.compat import ToolLoadError, refused_tool_lines
from plait.agents.interactions import load_interactions
from plait.agents.tool_pool import load_tools
from plait.agents.worker import load_loop_configs
from plait.configtree import ConfigError

from tests.test_config_verl_failures import alias_bomb


@pytest.fixture
def bomb(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(12))  # 10**13 values if expanded
    return str(path)


def test_an_alias_bomb_in_any_agent_yaml_is_one_line_and_costs_nothing(bomb):
    with pytest.raises(ConfigError, match="agent_loop_config_path=.*not valid YAML: its aliases expand"):
        load_loop_configs(bomb)
    with pytest.raises(ToolLoadError, match="bomb.yaml: not valid YAML: its aliases expand"):
        load_tools(bomb, None)
    with pytest.raises(ToolLoadError, match="bomb.yaml: not valid YAML: its aliases expand"):
        load_interactions(bomb)
    assert refused_tool_lines(bomb) == []  # the start-time look leaves the file to the load above to name

"""The YAML reading of config files and overrides: numbers in decimal only."""
from __future__ import annotations

import re

import yaml


class DecimalLoader(yaml.SafeLoader):
    """yaml.safe_load with decimal numbers only: YAML 1.1's 010 is 8 (train.max_steps=010 would train
    8 steps), 1:30 is 90 (and 1:30.0 is 90.0), 0x10 is 16. Those are text here, which a number key
    refuses by name."""


DecimalLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
INT = re.compile(r"^[-+]?(0|[1-9][0-9_]*)$")
# PyYAML's float pattern without its base-60 branch, and with a digit after a leading dot (`._`
# is text: PyYAML's dumper writes it unquoted, and its float constructor cannot read it)
FLOAT = re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
                   r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
DecimalLoader.add_implicit_resolver("tag:yaml.org,2002:int", INT, list("-+0123456789"))
DecimalLoader.add_implicit_resolver("tag:yaml.org,2002:float", FLOAT, list("-+0123456789."))


def _int_or_text(loader: yaml.SafeLoader, node: yaml.ScalarNode):
    """An integer, or its text where it is not decimal (an explicit `!!int 010`) or has more digits
    than Python reads as int (4,300): a key that takes an int then refuses it by name, one that
    takes a float reads it as inf and refuses that."""
    if not INT.match(node.value):
        return node.value
    try:
        return loader.construct_yaml_int(node)
    except ValueError:
        return node.value


def _float_or_text(loader: yaml.SafeLoader, node: yaml.ScalarNode):
    """A float, or its text where it is not decimal (an explicit `!!float 1:30`)."""
    return loader.construct_yaml_float(node) if FLOAT.match(node.value) or INT.match(node.value) else node.value


DecimalLoader.add_constructor("tag:yaml.org,2002:int", _int_or_text)
DecimalLoader.add_constructor("tag:yaml.org,2002:float", _float_or_text)

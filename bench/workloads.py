"""Benchmark workloads: fixed prompt sets that mirror how people use a local model.

- edit: return a ~50-line function with a small change (output mostly repeats the input: the coding-assistant case)
- summary: summarise a long passage and quote from it
- chat: free-form prose
- json: reformat structured data
plus sampled variants (temperature 0.7, seeded) of edit and chat, and the json prompts constrained: by a JSON schema
(json-schema) and as a forced tool call (tool-call).
"""

from __future__ import annotations

from dataclasses import dataclass

INVENTORY = '''class Inventory:
    """Track stock levels and a log of every change."""

    def __init__(self, warehouse):
        self.warehouse = warehouse
        self.items = {}
        self.log = []

    def add(self, name, qty):
        if qty <= 0:
            raise ValueError("qty must be positive")
        self.items[name] = self.items.get(name, 0) + qty
        self.log.append(("add", name, qty))

    def remove(self, name, qty):
        have = self.items.get(name, 0)
        if qty > have:
            raise ValueError("not enough " + name)
        self.items[name] = have - qty
        if self.items[name] == 0:
            del self.items[name]
        self.log.append(("remove", name, qty))

    def count(self, name):
        return self.items.get(name, 0)

    def total(self):
        return sum(self.items.values())

    def names(self):
        return sorted(self.items)

    def history(self, name=None):
        if name is None:
            return list(self.log)
        return [entry for entry in self.log if entry[1] == name]

    def low_stock(self, threshold):
        return [n for n, q in self.items.items() if q < threshold]

    def transfer(self, other, name, qty):
        self.remove(name, qty)
        other.add(name, qty)
        self.log.append(("transfer", name, qty))

    def report(self):
        lines = ["Warehouse " + self.warehouse]
        for name in self.names():
            lines.append(name + ": " + str(self.items[name]))
        lines.append("total: " + str(self.total()))
        return "\\n".join(lines)
'''

PARSER = '''def parse_config(text):
    """Parse a simple INI-like configuration into nested dictionaries."""
    result = {}
    section = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#") or line.startswith(";"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
            if not section:
                raise ValueError("empty section name on line " + str(number))
            result.setdefault(section, {})
            continue
        if "=" not in line:
            raise ValueError("expected key = value on line " + str(number))
        key, value = line.split("=", 1)
        key = key.strip()
        value = value.strip()
        if not key:
            raise ValueError("empty key on line " + str(number))
        if value.lower() in ("true", "yes", "on"):
            value = True
        elif value.lower() in ("false", "no", "off"):
            value = False
        else:
            try:
                value = int(value)
            except ValueError:
                try:
                    value = float(value)
                except ValueError:
                    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\\"":
                        value = value[1:-1]
        if section is None:
            result[key] = value
        else:
            result[section][key] = value
    return result


def get_option(config, path, default=None):
    node = config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
'''

PASSAGE_CANALS = (
    "The city's canals were dug in the seventeenth century, when merchants needed a way to move goods from the "
    "harbour to the warehouses without clogging the narrow streets. Each canal was lined with brick and timber, and "
    "the houses along them were built on wooden piles driven deep into the soft clay. For two hundred years the "
    "system worked well: barges carried grain, cloth and spices, and the tides flushed the water twice a day. By the "
    "nineteenth century, however, the population had tripled, and the canals had become open sewers. Cholera "
    "outbreaks in 1832 and 1849 killed thousands, and a commission of engineers recommended filling the canals in "
    "altogether. The merchants objected, arguing that the waterways were still the cheapest way to move heavy "
    "loads. A compromise was reached: a network of pumping stations would refresh the water, and new laws forbade "
    "dumping waste into it. The pumping stations, powered first by steam and later by electricity, still operate "
    "today. In the twentieth century the barges gave way to lorries, and several canals were paved over to make "
    "roads. Those that survived became the city's most valuable asset, drawing millions of visitors a year. "
    "Historians now describe the 1850 compromise as 'the decision that saved the city twice': once from disease, "
    "and once from the loss of its character. The chief engineer of the commission, Maria Velden, wrote in her "
    "final report that 'a city that forgets its water forgets itself'."
)

PASSAGE_BEES = (
    "Honeybee colonies make collective decisions without a leader. When a colony outgrows its hive in late spring, "
    "the old queen leaves with about half of the workers and settles temporarily on a tree branch. From this "
    "swarm, a few hundred experienced foragers fly out as scouts to search for a new home: a cavity of the right "
    "volume, with a small entrance, well above the ground. A scout that finds a promising site returns to the "
    "swarm and performs a waggle dance whose direction and duration encode the site's location. The better the "
    "site, the longer and more enthusiastically she dances, and the more recruits she attracts. Other scouts "
    "inspect the site themselves and, if they agree, dance for it too. Support for poor sites fades because their "
    "advocates dance less and eventually stop. Within a day or two, one site gathers a quorum of about fifteen to "
    "twenty scouts at the site itself. When the scouts sense the quorum, they return and produce a piping signal "
    "that warms up the flight muscles of the whole swarm, which then lifts off and flies to the chosen cavity. "
    "Researchers have found that the process picks the best available site in most trials, and they have compared "
    "it to how neurons in a brain compete until one option wins. One biologist summarised it as 'a democracy of "
    "dancers, where the loudest argument is the one backed by the best evidence'."
)


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]
    temperature: float = 0.0
    seed: int | None = None
    extra: tuple[tuple[str, object], ...] = ()  # request fields of a constrained workload (response_format, tools)
    peer: bool = True  # llama-server serves it too (it does not force tool calls)


TEAM_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "role": {"enum": ["engineer", "designer", "manager", "analyst"]},
            "team": {"type": "string"},
            "start_year": {"type": "integer"},
        },
        "required": ["id", "name", "role", "team", "start_year"],
        "additionalProperties": False,
    },
}
ADD_PEOPLE_TOOL = {
    "type": "function",
    "function": {
        "name": "add_people",
        "description": "Add people to the staff directory",
        "parameters": {"type": "object", "properties": {"people": TEAM_SCHEMA}, "required": ["people"]},
    },
}


WORKLOADS = (
    Workload(
        "edit",
        (
            "Rename the method `count` to `quantity` everywhere in this class and return the whole class, "
            "with no explanation:\n\n" + INVENTORY,
            "In this code, make `get_option` raise KeyError instead of returning the default when `default` is "
            "None. Return the complete code, with no explanation:\n\n" + PARSER,
        ),
    ),
    Workload(
        "summary",
        (
            "Summarise the following passage in one paragraph, then quote the two most important sentences "
            "exactly:\n\n" + PASSAGE_CANALS,
            "Summarise the following passage in one paragraph, then quote the two most important sentences "
            "exactly:\n\n" + PASSAGE_BEES,
        ),
    ),
    Workload(
        "chat",
        (
            "Write a short story about a robot who learns to paint.",
            "What are some good habits for staying productive when working from home? Explain each one.",
        ),
    ),
    Workload(
        "json",
        (
            "Convert this table to a JSON array of objects with keys id, name, role, team, start_year:\n"
            "1 | Ada Moreno | engineer | platform | 2019\n2 | Ben Okafor | designer | mobile | 2021\n"
            "3 | Chen Li | manager | platform | 2017\n4 | Dana Ruiz | engineer | data | 2022\n"
            "5 | Eli Novak | analyst | data | 2020\n6 | Fay Haddad | engineer | mobile | 2018\n",
            "Rewrite this YAML as pretty-printed JSON:\n\nserver:\n  host: 127.0.0.1\n  port: 8000\n  workers: 4\n"
            "database:\n  engine: postgres\n  name: shop\n  user: app\n  pool:\n    min: 2\n    max: 10\n"
            "features:\n  - search\n  - checkout\n  - reviews\nlogging:\n  level: info\n  file: /var/log/shop.log\n",
        ),
    ),
    Workload("edit-t0.7", (), temperature=0.7, seed=1234),
    Workload("chat-t0.7", (), temperature=0.7, seed=1234),
    # The json prompts, constrained: by a schema (response_format), and as a forced tool call.
    Workload(
        "json-schema",
        (),
        extra=(("response_format", {"type": "json_schema", "json_schema": {"name": "team", "schema": TEAM_SCHEMA}}),),
    ),
    Workload(
        "tool-call",
        (),
        extra=(("tools", [ADD_PEOPLE_TOOL]), ("tool_choice", "required")),
        peer=False,
    ),
)


def workloads(quick: bool) -> list[Workload]:
    """The workload list; sampled variants reuse the prompts of their greedy twin. Quick mode: one prompt each."""
    by_name = {w.name: w for w in WORKLOADS}
    out = []
    for w in WORKLOADS:
        prompts = w.prompts or by_name[_twin(w.name)].prompts
        out.append(Workload(w.name, prompts[:1] if quick else prompts, w.temperature, w.seed, w.extra, w.peer))
    return out


def _twin(name: str) -> str:
    """The workload whose prompts a variant reuses: edit-t0.7 -> edit; json-schema and tool-call -> json."""
    return "json" if name in ("json-schema", "tool-call") else name.split("-t")[0]

"""`baton prefill`: flags come from `baton.config.PrefillServiceConfig`."""

from baton.commands.service import ServiceCommand
from baton.config import PrefillServiceConfig

_command = ServiceCommand(PrefillServiceConfig, "baton.prefill.server")
add_arguments = _command.add_arguments
load_config = _command.load_config
run = _command.run

"""`baton decode`: flags come from `baton.config.DecodeServiceConfig`."""

from baton.commands.service import ServiceCommand
from baton.config import DecodeServiceConfig

_command = ServiceCommand(DecodeServiceConfig, "baton.decode.server")
add_arguments = _command.add_arguments
load_config = _command.load_config
run = _command.run

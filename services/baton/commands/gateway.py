"""`baton gateway`: flags come from `baton.config.GatewayServiceConfig`."""

from baton.commands.service import ServiceCommand
from baton.config import GatewayServiceConfig

_command = ServiceCommand(GatewayServiceConfig, "baton.gateway.server")
add_arguments = _command.add_arguments
load_config = _command.load_config
run = _command.run

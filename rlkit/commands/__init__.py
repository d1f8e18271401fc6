"""The CLI's commands beside the stages' own (`rlkit sft`, `rlkit grpo`): each module adds its
subcommand (`add_parser`) and runs it."""

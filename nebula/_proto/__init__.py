"""Generated protobuf modules (scripts/gen_proto); do not edit."""

"""The `hsx` command line: it stands above the roles and the tools and imports them; nothing imports it."""

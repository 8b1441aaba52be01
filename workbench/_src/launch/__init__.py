"""Everything that starts and talks to processes: the process backends' launcher, the processes
it starts (worker_main, server_main), their channel back to the launcher, and what travels on it."""

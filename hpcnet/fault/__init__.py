"""Failure detection and injection: the flight recorder, heartbeats, the monitor thread, deadlines and the
native watchdog, memory watch, and the ``fault.*`` injector.
"""

from wf_launch.observe.interrupt import catch_sigint, exit_interrupted, interrupted

catch_sigint()  # before the heavy imports: a Ctrl-C while they run exits 130 with one line
try:
    from wf_launch.cli import main
except BaseException:
    if not interrupted():
        raise
    exit_interrupted()
if interrupted():  # a library's bare ``except:`` swallowed the KeyboardInterrupt of an import
    exit_interrupted()

__all__ = []

if __name__ == "__main__":
    main()

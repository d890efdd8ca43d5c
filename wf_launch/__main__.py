from wf_launch.cli import main

__all__ = []

if __name__ == "__main__":
    main()

if __name__ == "__main__":
    from remat_dist.cli.main import main

    raise SystemExit(main())

from specforge.train.trainer import main
import sys
sys.exit(main())

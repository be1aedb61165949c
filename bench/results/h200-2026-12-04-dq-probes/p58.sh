export PYTHONPATH=$PWD
for v in 8 9 0; do timeout 60 python3 .probe/p55.py $v 2>&1 | tail -6; done | tee $OUT/p58.txt

// How torch's dtypes and ChainerMN's reduce kinds map onto MPI datatypes and ops. MPI has no
// float16 or bfloat16: they travel as 2-byte types reduced by our own ops. Types without an MPI
// counterpart (complex, float8, ...) only move, never reduce.
#pragma once

#include "types.h"

#include <c10/core/ScalarType.h>
#include <mpi.h>

namespace chainermn::mpi {

// Creates the datatypes and ops MPI lacks; once per process, after initialize(). Safe to call again.
void createTypes();

MPI_Datatype mpiType(c10::ScalarType dtype);

// Throws when `op` is not defined for `dtype` (bitwise ops on float16, ...).
MPI_Op mpiOp(ReduceKind op, c10::ScalarType dtype);

}  // namespace chainermn::mpi

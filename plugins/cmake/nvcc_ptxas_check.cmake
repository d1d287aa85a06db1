# Compile a .cu file with nvcc for the given SM architectures, keep ptxas's resource report, and
# fail on register spills or local memory (a stack frame): the kernels are memory-bound and
# must keep every value in registers.
#
# Compile and check:  cmake -DNVCC=... -DSRC=x.cu -DOBJ=x.o -DARCHS=80,90 -DREPORT=r.txt
#                           [-DINCLUDE_DIR=...] -P nvcc_ptxas_check.cmake
# Check a saved log:  cmake -DLOG=ptxas.log -DREPORT=r.txt -P nvcc_ptxas_check.cmake
cmake_minimum_required(VERSION 3.18)

if(NOT DEFINED REPORT)
  message(FATAL_ERROR "nvcc_ptxas_check: pass -DREPORT=<report file>")
endif()

if(DEFINED NVCC)
  string(REPLACE "," ";" arch_list "${ARCHS}")
  list(SORT arch_list COMPARE NATURAL)
  list(GET arch_list -1 newest)
  set(gencode "")
  foreach(arch IN LISTS arch_list)
    list(APPEND gencode "-gencode" "arch=compute_${arch},code=sm_${arch}")
  endforeach()
  # PTX of the newest architecture too, so later GPUs can JIT-compile the kernels.
  list(APPEND gencode "-gencode" "arch=compute_${newest},code=compute_${newest}")
  set(includes "")
  if(DEFINED INCLUDE_DIR)
    set(includes "-I${INCLUDE_DIR}")
  endif()
  execute_process(
    COMMAND "${NVCC}" -std=c++17 -O3 -Xcompiler=-fPIC,-fvisibility=hidden -Xptxas=-v
            --display-error-number -Werror all-warnings ${includes} ${gencode} -c "${SRC}" -o "${OBJ}"
    RESULT_VARIABLE rc
    OUTPUT_VARIABLE log
    ERROR_VARIABLE log)
  get_filename_component(report_dir "${REPORT}" DIRECTORY)
  file(WRITE "${report_dir}/ptxas.log" "${log}")
  if(NOT rc EQUAL 0)
    file(REMOVE "${OBJ}")
    message(FATAL_ERROR "nvcc failed (exit ${rc}) on ${SRC}:\n${log}")
  endif()
elseif(DEFINED LOG)
  file(READ "${LOG}" log)
else()
  message(FATAL_ERROR "nvcc_ptxas_check: pass -DNVCC=... -DSRC=... -DOBJ=... or -DLOG=...")
endif()

# ptxas -v prints, per kernel and architecture:
#   ptxas info    : Compiling entry function '<mangled>' for 'sm_90'
#       N bytes stack frame, N bytes spill stores, N bytes spill loads
#   ptxas info    : Used N registers, ...
string(REPLACE "\r" "" log "${log}")
string(REPLACE ";" "," log "${log}")
string(REPLACE "\n" ";" lines "${log}")
set(names "")
set(rows "")
set(bad "")
set(kernel "")
foreach(line IN LISTS lines)
  if(line MATCHES "Compiling entry function '([^']+)' for '(sm_[0-9a-z]+)'")
    set(kernel "${CMAKE_MATCH_1}")
    set(arch "${CMAKE_MATCH_2}")
    set(stack 0)
    set(stores 0)
    set(loads 0)
  elseif(kernel AND line MATCHES "([0-9]+) bytes stack frame, ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads")
    set(stack "${CMAKE_MATCH_1}")
    set(stores "${CMAKE_MATCH_2}")
    set(loads "${CMAKE_MATCH_3}")
  elseif(kernel AND line MATCHES "Used ([0-9]+) registers")
    set(regs "${CMAKE_MATCH_1}")
    list(APPEND names "${kernel}")
    list(APPEND rows "${arch}|${regs}|${stack}|${stores}|${loads}")
    if(stack GREATER 0 OR stores GREATER 0 OR loads GREATER 0)
      list(APPEND bad "${kernel} on ${arch}: ${stack} bytes stack frame, ${stores} bytes spill stores, ${loads} bytes spill loads")
    endif()
    set(kernel "")
  endif()
endforeach()

list(LENGTH rows count)
if(count EQUAL 0)
  message(FATAL_ERROR "nvcc_ptxas_check: no kernel found in the ptxas output (was it run with -Xptxas -v?)")
endif()

# Readable kernel names for the report.
find_program(CXXFILT NAMES c++filt cu++filt)
set(pretty "${names}")
if(CXXFILT)
  execute_process(COMMAND "${CXXFILT}" ${names} OUTPUT_VARIABLE demangled RESULT_VARIABLE frc)
  if(frc EQUAL 0)
    string(REPLACE ";" "," demangled "${demangled}")
    string(STRIP "${demangled}" demangled)
    string(REPLACE "\n" ";" pretty "${demangled}")
  endif()
endif()

set(text "arch\tregisters\tstack_bytes\tspill_store_bytes\tspill_load_bytes\tkernel\n")
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  list(GET rows ${i} row)
  list(GET pretty ${i} name)
  string(REPLACE "|" "\t" row "${row}")
  string(APPEND text "${row}\t${name}\n")
endforeach()
file(WRITE "${REPORT}" "${text}")

if(bad)
  if(DEFINED OBJ)
    file(REMOVE "${OBJ}")
  endif()
  string(REPLACE ";" "\n  " bad "${bad}")
  message(FATAL_ERROR "register spills or local memory in the rotary kernels (report: ${REPORT}):\n  ${bad}\n"
                      "Reduce the values a thread keeps live (smaller packs, fewer unrolled pairs).")
endif()
message(STATUS "ptxas: ${count} kernel builds, no spills, no local memory (report: ${REPORT})")
